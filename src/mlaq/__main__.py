from mlaq.cli import main

raise SystemExit(main())
