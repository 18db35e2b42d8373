"""The offline GPU bundle: lms-launch's runtime (TensorFlow with its CUDA libraries) in parts of a chosen
size, for a GPU machine without network (docs/gpu-bundle.md).

- `pack`: makes the bundle on a machine with network (`lms-launch bundle`, `main(argv)`).
- `have`: what the target already has, and what must be carried.
- `archive`: a folder's files as a tar in independent xz streams, cut into parts.
- `elf`: shared libraries' sonames, and the empty stand-ins for CUDA libraries TensorFlow only loads.
- `manifest`, `unpack`, `check`: travel with the parts; standard library only (check.py imports
  TensorFlow from the unpacked bundle).
"""


def main(argv: list[str] | None = None) -> int:
    from launcher.bundle.pack import main as pack_main

    return pack_main(argv)
