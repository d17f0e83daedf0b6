"""Stand-ins for engine packages whose compiled parts cannot load here, put first on sys.path by an adapted engine
test folder (never by this repository's own tests): the functions specdec_ext's shims replace are the shims', the
engine's reference kernels the tests compare against are reference PyTorch, its JIT a no-op; anything else raises."""
