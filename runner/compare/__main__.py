from runner.compare.sweep import main

main()
