"""Shape rules of the model's kernels, readable without importing torch (the launchers' preflight
checks a layout against them before any process starts)."""

# torch._grouped_mm needs every row stride to be a multiple of 16 bytes; 8 elements covers bf16
# and fp32, so the hidden and expert widths must be multiples of this on the grouped path.
GROUPED_MM_ALIGNMENT = 8
