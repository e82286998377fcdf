"""``python -m sparse_ref``: the package is a library; say which commands run it."""
import sys

sys.exit("sparse_ref is a library. Run: python -m sparse_ref.demo (sparse against dense decode, --help lists "
         "the flags), python -m sparse_ref.bench (GPU benchmarks), or make tutorial (the notebooks).")
