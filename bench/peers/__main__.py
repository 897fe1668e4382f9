"""``python3 -m bench.peers``: see bench/peers/__init__.py."""

from bench.peers.cli import main

if __name__ == "__main__":
    main()
