"""Stand-in `flashinfer.jit`: there is nothing to compile ahead (the shim's kernels are built with specdec_ext)."""


def build_jit_specs(*args, **kwargs) -> None:
    return None


def __getattr__(name):
    raise AttributeError(f"flashinfer.jit.{name} is not part of specdec_ext's stand-in")
