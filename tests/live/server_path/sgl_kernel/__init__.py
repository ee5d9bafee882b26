"""A placeholder for sgl_kernel on the live test servers' PYTHONPATH (tests/live only).

SGLang's CPU engine imports names from sgl_kernel at start-up; its CPU build is on no package
registry, and the tiny model on torch_native attention calls none of them. Any name imports;
calling one raises, naming it, so a code path that does need the kernel fails loudly.
"""
__version__ = "0.0.0+placeholder"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name}: a placeholder on the CPU test servers")
    unavailable.__name__ = name
    return unavailable
