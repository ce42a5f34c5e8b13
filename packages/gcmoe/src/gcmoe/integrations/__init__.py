"""Adapters that put gcmoe layers into other libraries' models (import each submodule directly; each needs its
library): gcmoe.integrations.transformers swaps the MoE blocks of Hugging Face transformers models."""
