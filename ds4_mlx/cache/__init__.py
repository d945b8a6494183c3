"""The cache geometry (`geometry`), per-layer caches (`layers`), saving sessions (`state`) and the disk
store (`store`)."""


def add_disk_arguments(parser):
    """`--kv-disk-dir` and `--kv-disk-space-mb` (for `serve` and `chat`)."""
    parser.add_argument("--kv-disk-dir", help="save sessions in this folder and reuse them, also after a restart")
    parser.add_argument("--kv-disk-space-mb", type=float, default=4096,
                        help="most megabytes (MiB) the folder may hold (default %(default)g)")


def disk_store_from_args(args, **options):
    """A `DiskStore` for the parsed flags, or None without --kv-disk-dir."""
    if not args.kv_disk_dir:
        return None
    if args.kv_disk_space_mb <= 0:
        raise ValueError("--kv-disk-space-mb must be positive")
    from ds4_mlx.cache.store import DiskStore

    return DiskStore(args.kv_disk_dir, args.kv_disk_space_mb, **options)
