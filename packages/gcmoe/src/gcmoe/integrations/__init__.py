"""Adapters that put gcmoe layers into other libraries' models (import each submodule directly; each needs its
library): gcmoe.integrations.transformers swaps the MoE blocks of Hugging Face transformers models;
gcmoe.integrations.vllm is a vLLM fused-MoE method (quantization="gcmoe") that packs the experts once after loading."""
