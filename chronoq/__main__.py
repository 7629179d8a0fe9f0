from chronoq.cli.main import main

main()
