from silofs.cli import main

main()
