"""`python -m dr.cli`."""

from dr.cli import main

main()
