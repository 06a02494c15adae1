import sys

from distserve.distbench.cli import main

sys.exit(main())
