"""python -m asyncfp8.report RUN_DIR...: finished runs compared."""

from asyncfp8.report.compare import main

if __name__ == "__main__":
    main()
