from prepare.cli import main

main()
