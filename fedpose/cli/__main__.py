import sys

from fedpose.cli import main

sys.exit(main())
