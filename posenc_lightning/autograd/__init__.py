"""Autograd Functions with hand-written backwards that `functional`'s formulas run on: RoPE's
half-layout rotation (`rotary`) and the learned rotations' eigen-decomposition and per-token
rotation (`lie`). They know nothing of positions or encodings and import nothing of the package;
an encoding's own Functions live with the encoding (`encodings.fire`, `encodings.cope`)."""
