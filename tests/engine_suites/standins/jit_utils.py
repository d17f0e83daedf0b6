"""Stand-in for FlashInfer's tests/jit_utils.py (not shipped in its sdist): the modules to compile ahead, none here."""


def gen_prefill_attention_modules(*args, **kwargs) -> list:
    return []


def gen_decode_attention_modules(*args, **kwargs) -> list:
    return []
