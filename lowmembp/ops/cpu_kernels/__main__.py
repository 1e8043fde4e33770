"""``python -m lowmembp.ops.cpu_kernels``: build (or find in the cache) the CPU fast path's C kernels and its C++
autograd extension now, rather than on the first call, and say where they are. Exit 0 when both are available,
1 when either is not (the reason is printed; the library then runs its Python route, with the same results)."""
from __future__ import annotations

import sys

from lowmembp.ops.cpu_kernels import build_info, extension, extension_info, library


def main() -> int:
    ok = True
    for what, load, info in (("C kernels (kernels.c)", library, build_info),
                             ("C++ autograd extension (autograd.cpp)", extension, extension_info)):
        available = load() is not None
        facts = info()
        if available:
            how = f"built in {facts['seconds']:.1f} s" if facts["compiles"] else "cached"
            print(f"{what}: {facts['path']} ({how})")
        else:
            print(f"{what}: not available: {facts['reason'] or 'turned off by its environment switch'}")
        ok &= available
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
