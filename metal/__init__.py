"""Metal kernel sources, shipped inside the package as ``dflash_mlx.metal``."""
