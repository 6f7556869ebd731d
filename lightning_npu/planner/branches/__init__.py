"""Multi-branch models (CLIP's towers, each at its own tp: `branch_layouts`): their description, cost, search and report."""
