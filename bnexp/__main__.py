"""Allow ``python -m bnexp ...`` (and ``torchrun -m bnexp ...``)."""

from bnexp.cli import main

if __name__ == "__main__":
    main()
