import sys

from launcher.bundle.pack import main

sys.exit(main(sys.argv[1:]))
