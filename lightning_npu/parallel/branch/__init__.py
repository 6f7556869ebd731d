"""Per-branch layouts (`branch_layouts`): a submodule's own (branch dp x branch tp) inside each top-level tp group."""
