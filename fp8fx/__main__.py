from fp8fx.cli import main

main()
