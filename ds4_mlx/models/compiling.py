"""Module methods through `mx.compile`, named by reference (`compiled`)."""

import os
from functools import partial, wraps

import mlx.core as mx

from ds4_mlx.models import kernels


def compiled(method):
    """A module method through `mx.compile`, traced per module instance and reading the module's current
    parameters at every call (so loading, quantizing or casting later is seen): fewer graph nodes and no
    Python per op. Traced anew when custom kernels are switched on or off; the plain method when
    DS4_MLX_COMPILE=0. Arguments that are not arrays are constants of a trace (a new value, a new trace)."""
    name = method.__name__

    @wraps(method)
    def call(module, *args):
        if os.environ.get("DS4_MLX_COMPILE", "1") == "0":
            return method(module, *args)
        traces = module.__dict__.setdefault("_compiled", {})
        if traces.get("kernels") != kernels.generation():
            traces.clear()
            traces["kernels"] = kernels.generation()
        if name not in traces:
            traces[name] = _traced_safely(partial(method, module), module.state, lambda: traces.pop(name, None))
        return traces[name](*args)

    return call


def _traced_safely(fn, state, forget):
    """`mx.compile(fn, inputs=state)` that raises what `fn` raises while it is traced. MLX puts the
    module's parameters back after a trace only when it returns: one that raised would leave them as
    tracers, breaking the model for the rest of the process. So the trace returns nothing then, the
    error is raised again outside, and `forget` drops the empty trace."""
    failed = []

    def traced(*args):
        try:
            return fn(*args)
        except BaseException as e:
            failed.append(e)
            return ()

    run = mx.compile(traced, inputs=state)

    def call(*args):
        out = run(*args)
        if failed:
            forget()
            raise failed.pop()
        return out

    return call
