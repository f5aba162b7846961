"""What quantlab ships or finds installed, so nothing is downloaded: the real models it is measured
on (`models`) and the bundled WikiText-2 text plus the readers for text files (`text`)."""
