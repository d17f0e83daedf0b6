"""What the test modules share, so that no test module imports another (tests/gpu included). One module per subject,
and one place for each helper: import it from its module (this package re-exports nothing).

models               the tiny random models (built once per process and shared, read-only: tiny_model, law models,
                     shipped_model), prompts, draft heads, transformers models of every supported architecture
gguf_files           GGUF files written as llama.cpp writes them, from a small random transformers model
laws                 exact laws the decoder's tokens are tested against, and the decoder's samples of them
chi_square           chi-square p-values of counts against laws, the power against a 1% bias, assert_law
decoder_probes       a running decoder's KV cache against a fresh prefill (CacheCheck), the tree paths it accepted
sampling_inputs      inputs of the sampling ops: chains, trees, their padded and flat layouts
verify_attention     verify_attention's error bound and measure, and random tree masks
compat_backends      the backend an engine-shim check runs on (on)
compat_flashinfer, compat_sglang, compat_vllm, compat_transformers
                     the engine shims' cases and checks, run on the CPU and emulator by tests/ and on CUDA by tests/gpu
"""
