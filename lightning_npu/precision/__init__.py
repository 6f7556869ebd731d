"""Precision: `HybridPrecision` (the Lightning plugin), fp32 islands, the loss scaler, bf16 emulation."""
