"""Prompt modules: the PML schema language (pml), position ids and tenant
scopes (prompt_layout), and the schemas a frontend has registered
(schema_registry)."""
