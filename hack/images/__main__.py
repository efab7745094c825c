import sys

from hack.images.build import main

sys.exit(main())
