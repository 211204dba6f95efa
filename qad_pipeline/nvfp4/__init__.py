"""NVFP4 arithmetic and the recipes: the CPU kernels and their parity with Model Optimizer's, recipe files, AutoQuantize, layerwise calibration, weight folding, sizes and bits per element."""
