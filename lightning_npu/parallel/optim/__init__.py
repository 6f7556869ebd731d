"""The optimizer side: mixed-precision masters, unscale, skip and clip; ZeRO-1's distributed optimizer; the global grad norm."""
