"""A block probe that also keeps the most blocks a request held in a decode
step, for tests/test_speculative_decoding.py and its child
tests/plugin_speculative.py (a prompt longer than the budget holds its blocks
until it is compacted, at its first decode step)."""

from vllm_kvevict.probe import BlockProbe


class DecodeBlocks(BlockProbe):
    max_decode_blocks = 0

    def sample(self, output) -> None:
        super().sample(output)
        for m in self.managers():
            for req_id, blocks in m.req_to_blocks.items():
                req = self.scheduler.requests.get(req_id)
                # vLLM counts a step's tokens computed once it is scheduled: the
                # prompt's last chunk has num_computed == prompt, decode more.
                if req is not None and req.num_computed_tokens > req.num_prompt_tokens:
                    self.max_decode_blocks = max(self.max_decode_blocks, len(blocks))
