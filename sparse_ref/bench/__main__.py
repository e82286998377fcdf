"""``python -m sparse_ref.bench``: see ``sparse_ref.bench``."""

from sparse_ref.bench import main

main()
