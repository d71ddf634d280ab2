from kvctl.cli.main import main

main()
