import sys

from flopcount.cli.main import main

sys.exit(main())
