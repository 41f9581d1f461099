from grctl.cli import main

main()
