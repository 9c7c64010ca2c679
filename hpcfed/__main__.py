from hpcfed.cli import main

raise SystemExit(main())
