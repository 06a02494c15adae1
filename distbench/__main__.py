import sys

from distbench.cli import main

sys.exit(main())
