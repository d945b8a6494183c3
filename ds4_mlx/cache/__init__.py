"""The cache geometry (`geometry`), per-layer caches (`layers`), saving sessions (`state`) and the disk
store (`store`)."""


def add_disk_arguments(parser):
    """`--kv-disk-dir` and `--kv-disk-space-mb` (for `serve` and `chat`)."""
    parser.add_argument("--kv-disk-dir", help="save sessions in this folder and reuse them, also after a restart")
    parser.add_argument("--kv-disk-space-mb", type=float, default=4096,
                        help="most megabytes (MiB) the folder may hold (default %(default)g)")


# while a command runs on several machines (`ds4_mlx.distributed.run`): makes the store of sessions in
# lockstep instead of a `DiskStore`, (directory, budget_mb, **options) -> store
store_factory = None


def disk_store_from_args(args, **options):
    """A `DiskStore` for the parsed flags; None without --kv-disk-dir, or when the folder cannot be used
    (read-only, not a folder, not ours to write): then one warning says so and the caller goes on without
    the store, as it does when a save fails. A folder that another process holds stops the caller."""
    if not args.kv_disk_dir:
        return None
    if args.kv_disk_space_mb <= 0:
        raise ValueError("--kv-disk-space-mb must be positive")
    import logging

    from ds4_mlx.cache.store import DiskStore, FolderInUse

    try:
        return (store_factory or DiskStore)(args.kv_disk_dir, args.kv_disk_space_mb, **options)
    except FolderInUse:
        raise
    except OSError as e:
        logging.getLogger("ds4_mlx.kv_disk").warning(
            f"kv disk: cannot use {args.kv_disk_dir} ({e}); going on without the disk store: no session is "
            "saved or restored")
        return None
