from lightning_ddp_plus.frontends.cli import main

main()
