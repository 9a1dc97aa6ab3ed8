"""`trinity-train plan`: a job of N ranks rehearsed in one process (DESIGN §14).

`trace` runs one iteration of the real model, parallel and optimizer code as one rank on fake
tensors over torch's fake process group; `collectives` is the one rule for what a rank sends;
the closed-form model, the hardware table, the step-time model and the layout search sit beside
them, and `report` prints trace and formula side by side.
"""
