from openalice_scheduler.cli import main

main()
