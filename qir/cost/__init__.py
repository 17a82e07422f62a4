"""The static cost model: per-kernel register, shared-memory and SASS figures, and the roofline
table built from them, read off NVRTC builds without a GPU (docs/cost-model.md)."""
