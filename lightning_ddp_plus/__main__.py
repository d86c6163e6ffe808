from lightning_ddp_plus.cli import main

main()
