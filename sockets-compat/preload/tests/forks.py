# Forking servers under the preload library (sockets-compat/preload/tests/programs.rs):
# `prefork PORT` (two children accept), `afteraccept PORT` (the child tries the inherited
# connection, the parent answers), `client PORT N`.
import os, socket, sys
mode, port = sys.argv[1], int(sys.argv[2])
if mode == "prefork":
    # Listen, fork two children; each accepts and echoes one connection.
    l = socket.create_server(("127.0.0.1", port))
    kids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            c, _ = l.accept()
            d = c.recv(100)
            c.sendall(b"child " + d)
            c.close()
            os._exit(0)
        kids.append(pid)
    l.close()
    ok = all(os.waitpid(p, 0)[1] == 0 for p in kids)
    print("prefork server ok" if ok else "prefork server FAILED")
elif mode == "afteraccept":
    # Accept, fork: the child tries the inherited connection (it must fail cleanly, not hang),
    # the parent answers on it.
    l = socket.create_server(("127.0.0.1", port))
    c, _ = l.accept()
    pid = os.fork()
    if pid == 0:
        c.settimeout(5)
        try:
            c.sendall(b"from the child")
            r = "child sent"
        except OSError as e:
            r = f"child: {type(e).__name__}"
        print(r, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    d = c.recv(100)
    c.sendall(b"parent " + d)
    c.close()
    print("afteraccept server ok")
else:
    n = int(sys.argv[3])
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"hello%d" % i)
        got = b""
        while True:
            d = s.recv(100)
            if not d: break
            got += d
        print("client got", got)
        s.close()
