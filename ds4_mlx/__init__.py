"""ds4-mlx: DeepSeek V4 Flash on MLX."""

__all__ = ["load", "Session", "SyncInterrupted"]


def __getattr__(name):  # lazy, so `ds4-mlx --help` and the server start fast
    if name == "load":
        from ds4_mlx.loader import load

        return load
    if name in ("Session", "SyncInterrupted"):
        from ds4_mlx import session

        return getattr(session, name)
    raise AttributeError(name)
