"""The block engine shared by sdpa's rows and the blockwise backend's tiles: one block budget and
its policy (`blocks`), the softmax-attention gradient by blocks (`block_grad`), and flush-to-zero
of denormals around the backends' own work on CPU (`denormals`)."""
