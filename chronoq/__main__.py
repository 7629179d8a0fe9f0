from chronoq.cli import main

main()
