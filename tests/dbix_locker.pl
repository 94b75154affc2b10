#!/usr/bin/perl
# DBIx::Locker itself, driven by tests/test_dbix_locker.py beside sqllocker. The module is not
# part of this project: the test puts its unmodified copy on PERL5LIB.
#
#   dbix_locker.pl DSN USER TABLE hold LOCKSTRING SECONDS
#       lock; print "locked <id>" (or "refused <error>"); then, for each line on stdin:
#       "unlock" -> print "unlocked" or "unlock failed <error>"; "leave" -> exit with the row
#       left behind, as a crashed process leaves it; "extend SECONDS" -> move the expiry to
#       SECONDS from now (the Lock's expires setter), print "extended"; "push SECONDS" -> move
#       the expiry SECONDS (which may be negative) from where it is, print "extended";
#       "cycle OTHER" -> lock OTHER too, with the same locker, and unlock it: print
#       "cycled <id>" (or "refused <error>", or "cycled <id>, unlock failed <error>").
#   dbix_locker.pl DSN USER TABLE count LOCKSTRING TIMES COUNTER MARKER
#       TIMES turns of: take the lock (trying again until it is free), create MARKER (which must
#       not exist: someone else inside means two holders), read COUNTER, pause, write it plus
#       one, remove MARKER, release. Prints "ids <id> <id> ...".
#   dbix_locker.pl DSN USER TABLE churn LOCKSTRINGS SECONDS LOG STATE
#       for SECONDS, or until STATE/stop exists: try one of the comma-separated LOCKSTRINGS at random, once; holding it,
#       create STATE/<n>.holder (which must not exist), add one to STATE/<n>.count, pause a few
#       ms, remove the marker, release. Appends "acquire|release <n> <id> <monotonic> <pid>" to
#       LOG (O_APPEND, one write per line), and "error <message>" for any failure but the
#       lockstring being held (a duplicate key, or MariaDB's deadlock between two inserts of it). Prints "acquired <count>".
#   dbix_locker.pl DSN USER TABLE purge
use strict;
use warnings;
use DBIx::Locker;
use Fcntl qw(O_CREAT O_EXCL O_WRONLY O_APPEND);
use Time::HiRes qw(sleep clock_gettime CLOCK_MONOTONIC);

$| = 1;
my ($dsn, $user, $table, $command, @args) = @ARGV;
my $locker = DBIx::Locker->new({ dbi_args => [ $dsn, $user, '' ], table => $table });

if ($command eq 'hold') {
    my ($lockstring, $seconds) = @args;
    my $lock = eval { $locker->lock($lockstring, { expires => $seconds }) };
    if (!$lock) {
        (my $error = $@) =~ s/\s+/ /g;
        print "refused $error\n";
        exit 0;
    }
    print "locked ", $lock->lock_id, "\n";
    while (my $line = <STDIN>) {
        chomp $line;
        if ($line eq 'unlock') {
            if (eval { $lock->unlock; 1 }) {
                print "unlocked\n";
            } else {
                (my $error = $@) =~ s/\s+/ /g;
                print "unlock failed $error\n";
            }
            $lock->is_locked(0);
            exit 0;
        }
        if ($line =~ /\Aextend (\d+)\z/) {
            $lock->expires(time + $1);
            print "extended\n";
            next;
        }
        if ($line =~ /\Apush (-?\d+)\z/) {
            $lock->expires($lock->expires + $1);
            print "extended\n";
            next;
        }
        if ($line eq 'leave') {
            $lock->is_locked(0);    # no unlock on the way out: the row stays, as after a crash
            exit 0;
        }
        if ($line =~ /\Acycle (.+)\z/) {
            my $other = eval { $locker->lock($1, { expires => $seconds }) };
            if (!$other) {
                (my $error = $@) =~ s/\s+/ /g;
                print "refused $error\n";
                next;
            }
            my $id = $other->lock_id // 'none';
            if (eval { $other->unlock; 1 }) {
                print "cycled $id\n";
            } else {
                (my $error = $@) =~ s/\s+/ /g;
                print "cycled $id, unlock failed $error\n";
                $other->is_locked(0);
            }
            next;
        }
    }
    exit 0;
}

if ($command eq 'count') {
    my ($lockstring, $times, $counter, $marker) = @args;
    my @ids;
    for (1 .. $times) {
        my $lock;
        until ($lock = eval { $locker->lock($lockstring, { expires => 60 }) }) {
            sleep(0.001 + rand(0.004));
        }
        sysopen(my $inside, $marker, O_CREAT | O_EXCL | O_WRONLY)
          or die "two holders at once: $marker exists ($!)\n";
        open(my $in, '<', $counter) or die "read $counter: $!\n";
        my $value = <$in>;
        close $in;
        sleep(0.02);
        open(my $out, '>', $counter) or die "write $counter: $!\n";
        print $out $value + 1;
        close $out;
        close $inside;
        unlink $marker or die "unlink $marker: $!\n";
        push @ids, $lock->lock_id;
        $lock->unlock;
    }
    print "ids @ids\n";
    exit 0;
}

if ($command eq 'churn') {
    my ($lockstrings, $seconds, $log, $state) = @args;
    my @names = split /,/, $lockstrings;
    sysopen(my $out, $log, O_CREAT | O_WRONLY | O_APPEND) or die "open $log: $!\n";
    my $say = sub { my $line = join(' ', @_) . "\n"; syswrite($out, $line) == length($line) or die "write $log: $!\n" };
    my $deadline = clock_gettime(CLOCK_MONOTONIC) + $seconds;
    my $acquired = 0;
    while (clock_gettime(CLOCK_MONOTONIC) < $deadline && !-e "$state/stop") {
        my $n = $names[int(rand(@names))];
        my $lock = eval { $locker->lock($n, { expires => 600 }) };
        if (!$lock) {
            (my $error = $@) =~ s/\s+/ /g;
            # Held, or InnoDB's answer to two inserts of one key at once: refused, not a fault.
            $say->('error', $error) unless $error =~ /duplicate|unique|deadlock found/i;
            sleep(0.002 + rand(0.01));
            next;
        }
        $say->('acquire', $n, $lock->lock_id, clock_gettime(CLOCK_MONOTONIC), $$);
        sysopen(my $inside, "$state/$n.holder", O_CREAT | O_EXCL | O_WRONLY)
          or $say->('error', "two holders of $n: marker exists ($!)");
        open(my $in, '<', "$state/$n.count") or die "read $state/$n.count: $!\n";
        my $value = <$in> // 0;
        close $in;
        sleep(0.005 + rand(0.02));
        open(my $write, '>', "$state/$n.count") or die "write $state/$n.count: $!\n";
        print $write $value + 1;
        close $write;
        close $inside if $inside;
        unlink "$state/$n.holder";
        $acquired++;
        $say->('release', $n, $lock->lock_id, clock_gettime(CLOCK_MONOTONIC), $$);
        if (!eval { $lock->unlock; 1 }) {
            (my $error = $@) =~ s/\s+/ /g;
            $say->('error', "unlock of $n: $error");
            $lock->is_locked(0);
        }
        sleep(rand(0.005));
    }
    print "acquired $acquired\n";
    exit 0;
}

if ($command eq 'purge') {
    $locker->purge_expired_locks;
    print "purged\n";
    exit 0;
}

die "unknown command $command\n";
