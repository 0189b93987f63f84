from prepare.cli.app import main

main()
