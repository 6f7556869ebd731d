"""What a user sees of a run under npu_hybrid: Lightning's model summary and progress bars, subclassed so that they
count the whole model and a resumed epoch (swapped in at the strategy's setup)."""
