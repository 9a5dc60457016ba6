"""Settings: every --kv-* flag declared once (flags) and the parsed, validated
values (settings.EvictionConfig with its offload and prompt-module parts)."""
