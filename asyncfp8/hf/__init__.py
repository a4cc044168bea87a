"""A Hugging Face model directory: checked before transformers reads it, its tokenizer, and
its weights loaded on this machine (with the CPU's half-precision GEMM fallback). Below
the engines, the precisions and the learner, which all read model directories;
`asyncfp8.models` hands the same functions on beside the models the project makes."""
